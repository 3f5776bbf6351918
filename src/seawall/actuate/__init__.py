"""actuate"""
