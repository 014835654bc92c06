"""A module that starts a thread when imported: a fork server that preloads it must not fork (test_forkserver)."""

import threading

threading.Thread(target=threading.Event().wait, daemon=True).start()
