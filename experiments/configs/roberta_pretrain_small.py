r"""A small RoBERTa (4 layers, 256 wide) pretrained with MLM on full sentences of local text.

  python -m experiments.bert --config=experiments/configs/roberta_pretrain_small.py \
      --workdir=/tmp/rp

RoBERTa's recipe (Liu et al. 2019) at small scale, beside bert_pretrain_small.py on the same
text: the encoder of `roberta_config()` (BERT's with LayerNorm eps 1e-5), masked LM only (no
NSP), FULL-SENTENCES inputs (data.sentence_task='full_sentences': consecutive sentences packed
into each row across document boundaries, an extra </s> between documents), masks drawn anew
for every batch (dynamic masking), no token types (data.type_vocab_size=1), a byte-level BPE
with RoBERTa's special tokens trained on the training documents (WORKDIR/tokenizer/, HF files),
and Adam's beta2 0.98. The text: the English side of Multi30k (every 8 captions a "document")
and Tiny Shakespeare (speeches separated by blank lines); 2% of the documents are held out and
evaluation reports the MLM loss and accuracy on them.
"""

from experiments.configs import bert_pretrain_small
from transformer_jax.models.bert import ROBERTA_ARCHITECTURE


def get_config():
  # bert_pretrain_small.py's text, model size and schedule; RoBERTa's objective and tokenizer.
  config = bert_pretrain_small.get_config()
  config.data.sentence_task = 'full_sentences'
  config.data.type_vocab_size = 1
  config.tokenizer.type = 'byte_bpe'
  config.model.update(ROBERTA_ARCHITECTURE)
  config.optimizer.b2 = 0.98  # RoBERTa's, for stability with large batches
  return config
