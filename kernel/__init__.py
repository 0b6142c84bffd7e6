"""shardbook.kernel"""
