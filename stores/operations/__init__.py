"""Operations as a person's commands (retry, resolve) change them: ``protocol``, ``postgres``, ``fake``."""
