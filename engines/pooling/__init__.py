"""Pooling models: embeddings, classification and cross-encoder scores from one prefill, no decode."""
