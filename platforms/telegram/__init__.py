"""The Telegram platform: its webhook parsing (``webhook``) and its sending adapter (``adapter``)."""
