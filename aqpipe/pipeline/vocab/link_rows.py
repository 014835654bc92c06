"""The `--link-rows` vocabulary (no torch import, so the configuration can check a name cheaply): which positions of
a padded batch cross a link (`aqpipe.pipeline.links.real_rows`)."""

LINK_ROWS = {
    "real": "only the positions each sample's attention mask marks (its real tokens), in both directions and in "
            "every codec; m(ξ) keeps only them",
    "padded": "every position of the padded batch, as fixed-shape pipelines send",
}
DEFAULT_LINK_ROWS = "real"
# A run directory written before `--link-rows` existed keeps its m(ξ) and its messages padded.
LINK_ROWS_BEFORE = "padded"


def recorded(config: dict) -> dict:
    """A run's recorded settings (its config.json, a checkpoint's record) with `--link-rows` as the run used it:
    `padded` where the record is older than the setting."""
    return {"link_rows": LINK_ROWS_BEFORE, **config}


def canonical(config: dict) -> dict:
    """A run's settings as their digest reads them: `--link-rows padded` left out, so that a run recorded before the
    setting existed and one that says `padded` have the same digest."""
    return {k: v for k, v in config.items() if not (k == "link_rows" and v == LINK_ROWS_BEFORE)}
