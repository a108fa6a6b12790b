"""homepd."""
