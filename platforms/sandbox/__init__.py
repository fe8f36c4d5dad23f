"""The Sandbox platform: the built-in sandbox chat's sending adapter."""
