"""What kvfabric asks of the host: memory, file modes and installed packages.

    pages.py        Scratch read buffers, memory mapped ahead of hot paths, chunk files mapped for copies
    permissions.py  private cache folders, files and pools (0700 / 0600), checks of wider modes
    extras.py       which optional package (`kvfabric[extra]`) brings each optional module
"""
