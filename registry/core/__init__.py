"""The basics every layer uses: settings (config.py), refs and names, the storage key layout, time
and sizes, progress, named fault points for the crash tests, and detached helper processes."""
