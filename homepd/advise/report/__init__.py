"""What a run shows: the evidence table as text, the pictures and their image files, bench slo's table."""
