"""The storage tier as the server runs it: which blocks have KV files, the IO workers' links
and the jobs sent to them, the scan at attach, free-space and capacity upkeep. The file
format and the IO worker process are :mod:`hpkv.io_workers`."""
