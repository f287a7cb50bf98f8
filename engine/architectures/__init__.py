"""The architectures of berth's encoder, one module per family (engine/encoder.py
builds and loads them): bert.py (BERT, DistilBERT, RoBERTa), mpnet.py,
modernbert.py; base.py holds what they share."""
