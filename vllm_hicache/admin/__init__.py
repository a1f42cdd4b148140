"""The admin side: the HTTP API and the attach/detach transaction it drives.
It sits above the scheduler half and talks to it only through
``HiCacheScheduler``'s public methods."""
