"""`hf-retrace bench` and `hf-retrace analyze`: the interleaved run (`run`), the methods it compares (`methods`),
the lossless check and outputs (`report`), paired bootstrap intervals (`stats`), timing instruments (`timing`),
figures (`plots`), and rejected-suffix statistics (`analyze`)."""
