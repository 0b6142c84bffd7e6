"""shardbook.magics"""
