"""The ids every model, tokenizer and decoder here agrees on.

PAD_ID is 0 so that freshly zeroed arrays are already padding, and 0 is also [PAD] in BERT's
vocab.txt and in the WordPiece vocabularies trained here. The SentencePiece tokenizers are
trained with pad=0, eos=1, bos=2, unk=3; decoding fills every position after EOS_ID with PAD_ID.
"""

PAD_ID = 0
EOS_ID = 1
BOS_ID = 2
UNK_ID = 3
