"""`python -m nanoflash.server ...`: the embedded SGLang-protocol server (nanoflash/server/http.py)."""
from nanoflash.server.http import main

if __name__ == "__main__":
    main()
