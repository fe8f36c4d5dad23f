"""A chat's debounce window, from filing to emission: ``window`` (the pure rule), ``protocol``, ``postgres`` (stores/windows/functions/20_windows.sql), ``fake``."""
