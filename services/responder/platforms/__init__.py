"""Platform adapters behind one interface (``base.Platform``)."""
