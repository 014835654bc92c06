"""The ranks' world: the grid (world = pp × dp, rank = replica·pp + stage), its process groups and each rank's
device (`grid`), and every collective a rank runs outside the link streams and the grad sync, counted in bytes by
traffic class (`comm`)."""
