"""elastictk.rendezvous"""
