"""Small widgets that are handed view records and draw them (they fetch nothing themselves)."""
