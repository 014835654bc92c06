"""The capacity plan (`--dry-run`, `aqpipe bench`, the refusal of a run that cannot fit): what each stage holds, traced
from its real forward; what each link and the grad sync send per step; the least step time the wire allows; the table
`--dry-run` prints."""
