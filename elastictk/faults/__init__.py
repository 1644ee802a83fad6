"""elastictk.faults"""
