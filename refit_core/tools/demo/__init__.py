"""``refit demo``: a real refit between two separately started programs, verified bitwise."""
