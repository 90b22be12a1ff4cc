"""pipecc.models: the model zoo, one plain-PyTorch model file per model (CONTRACT.md §2).

Each file defines build_model(**kwargs), example_inputs(batch_size, **kwargs),
example_target(batch_size, **kwargs), loss_fn(outputs, target) and TINY, the keyword
arguments of a version small enough for CPU tests.

    vgg16     VGG-16, configuration D (Simonyan & Zisserman 2014)       138.4M params
    resnet50  ResNet-50, bottleneck [3, 4, 6, 3] (He et al. 2015)         25.6M
    gnmt      GNMT, 8+8 LSTM layers with attention (Wu et al. 2016)      276.7M
    gpt       GPT-2 small (presets gpt2, gpt1-14, gpt2-xl), untied head  163.0M
    bert      BERT-base with a sequence-classification head              109.5M
    tiny_cnn  a few-op CNN with BatchNorm and a residual add, for tests
    mlp       a plain MLP, for tests
    chargpt     a character-level GPT on Python's documentation topics (pydoc_data)  0.12M
    digits_cnn  a small CNN on scikit-learn's bundled 8x8 digits (load_digits)      0.04M

chargpt and digits_cnn also define train_data(batch_size, **kwargs) and val_data(batch_size,
**kwargs): DataLoaders of (inputs, target) batches of real data that ships with Python or
scikit-learn (nothing downloaded), every batch exactly batch_size rows, the training order
shuffled by a torch.Generator seeded with the `seed` model argument.
"""
