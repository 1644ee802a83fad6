"""elastictk.timer"""
