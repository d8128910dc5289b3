"""The JAXJob operator (kopf)."""
