"""Out of homepd: a stored recommendation as config for `homepd serve` (apply) and as recipes for other engines."""
