"""elastictk.supervisor"""
