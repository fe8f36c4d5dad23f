"""The Generic platform: its webhook parsing (``webhook``) and its sending adapter (``adapter``)."""
