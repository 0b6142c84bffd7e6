"""shardbook.rankd"""
