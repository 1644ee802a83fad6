"""elastictk.metrics"""
