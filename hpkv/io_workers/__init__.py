"""io_workers"""
