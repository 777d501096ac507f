"""Pictures of what a Transformer does, one kind of picture per file:

  attention_maps.py  the softmax weights every attention module sows, read from one forward pass
                     of the model and labelled with their tokens (`AttentionMap`)
  heatmaps.py        those maps drawn: one head, a grid of heads and layers, TensorBoard images,
                     a folder of PNGs with an index.html
  positions.py       the sinusoidal position encoding as pictures
  curves.py          a workdir's metrics.jsonl as loss, BLEU/accuracy and learning-rate curves
  canvas.py          the matplotlib canvas they all draw on, and PNG files of exact pixel sizes

    maps = attention_maps.translation_attention(model, params, src_tok, tgt_tok, 'five', 'fünf')
    heatmaps.write_attention_report('/tmp/pictures', maps, title='numbers')  # PNGs + index.html
"""
