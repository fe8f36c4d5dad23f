"""``make demo``: the product working end to end in under a minute, with no platform
account and no API key."""
