"""An account (a Telegram bot, an Avito account, a generic sender): ``registry`` (every
account, credentials opened, kept current by notifications: what each process reads),
``protocol`` and ``postgres`` (whether the bot may send on it: paused by the platform or a
person, probed, resumed; shared/state/account.py's lifecycle), ``fake``."""
