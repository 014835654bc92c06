"""The link codecs: what crosses a stage boundary (activations forward, their gradients backward), by name in one
table (`specs`: each name's implementing class and what it can do), built and sized by `factory` (`build_codec`,
`message_bytes`). What every codec is made of: the base class and the encoded message (`base`), what a header says
of its codec (`codes`), how quantizing codecs round and scale (`options`). One module per codec family: the floats
(`floats`); the sample coders, cast, DirectQ (its rows: `directq`) and RTQ (`sample_coders`); AQ-SGD (`aqsgd`, with
its message parts `aqsgd_rows`, its rows' arithmetic `aqsgd_steps`, its fused rows `aqsgd_fused`, the m(ξ)
checksum `checksum` and the checks a receiver makes later `late_checks`); top-k (`topk`); TAH-Quant (`tahq`)."""
