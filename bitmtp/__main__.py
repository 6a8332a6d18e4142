from bitmtp.cli import entry

entry()
