r"""Multi30k English -> German as T5 does it: text to text, 'translate English to German: ' on
every source sentence, with a T5 v1.1-style model.

  python -m experiments.translate --config=experiments/configs/t5_multi30k.py \
      --config.data.dir=../shared/data/multi30k --workdir=/tmp/t5_m30k
  echo "A dog runs on the beach." | python -m experiments.translate --workdir=/tmp/t5_m30k \
      --mode=translate  # the prefix is added here too

The prefix is prepended at training, at validation (BLEU) and at --mode=translate alike (the
source tokenizer adds it), and the SentencePiece model is trained on the prefixed sources. The
vocabulary keeps T5's layout: 8,000 pieces plus 100 sentinel ids on top. The data, schedule and
evaluation are multi30k.py's; the model is T5 v1.1's design (`T5_V1_1_ARCHITECTURE`:
pre-RMSNorm, relative position buckets, gated-GELU feed-forward, no biases, unscaled
embeddings, attention logits not divided by sqrt(head_dim), an output layer of its own) at
multi30k.py's size (3+3 layers, 256 wide), with dropout 0.1 as T5 uses when fine-tuning.

Fine-tuning a pretrained T5 instead of training from scratch (config.init; the tokenizer is
the pretrained model's, never retrained, and copied into the workdir with the resolved model
config, so --mode=translate / evaluate need only the workdir; a rerun resumes as usual):

  # from a span-corruption workdir of ours (t5_span_corruption.py): its spm.model, sentinels
  # and params; config.model must match its sizes (a mismatch is one error naming the flags):
  python -m experiments.translate --config=experiments/configs/t5_multi30k.py \
      --config.init.workdir=/tmp/t5_span --config.model.emb_dim=128 \
      --config.model.mlp_dim=256 --config.model.num_encoder_layers=2 \
      --config.model.num_decoder_layers=2 --workdir=/tmp/t5_span_m30k
  # from a Hugging Face T5 directory, e.g. t5-small downloaded beforehand
  # (`huggingface-cli download t5-small --local-dir /data/t5-small`: config.json,
  # model.safetensors, tokenizer.json or spiece.model): its model, tokenizer (pad 0, eos 1,
  # sentinels at the top) and weights; config.model gives only dropout, dtypes, remat, scan
  # and the attention kernel. t5-small was pretrained with this very prefix on WMT En-De, so
  # it translates from step 0; its 60M parameters want a smaller learning rate than 1e-3:
  python -m experiments.translate --config=experiments/configs/t5_multi30k.py \
      --config.init.hf_dir=/data/t5-small --config.optimizer.learning_rate=3e-4 \
      --config.optimizer.warmup_steps=200 --workdir=/tmp/t5_small_m30k
  echo "A dog runs on the beach." | python -m experiments.translate \
      --workdir=/tmp/t5_small_m30k --mode=translate
"""

from experiments.configs import multi30k
from transformer_jax.models.encoder_decoder import T5_V1_1_ARCHITECTURE


def get_config():
  config = multi30k.get_config()
  config.data.source_prefix = 'translate English to German: '
  config.data.max_len = 72  # 64 + the prefix's tokens
  config.tokenizer.num_sentinels = 100
  config.model.update(T5_V1_1_ARCHITECTURE)
  config.model.update(
      dict(emb_dim=256, num_heads=4, mlp_dim=1024, num_encoder_layers=3, num_decoder_layers=3,
           dropout_rate=0.1, attention_dropout_rate=0.1))
  return config
