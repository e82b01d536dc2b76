"""See ARCHITECTURE in the README."""
