"""MAPS (Elhelo & Geva, 2025): what each attention head does to the vocabulary.

The package, by responsibility:

* :mod:`actstore.query.maps.defaults`    the authors' settings (k per relation, minimum pairs, threshold) and
                                :class:`MapsError`;
* :mod:`actstore.query.maps.pairs`       pair files, tokenization, the single-token rule, the minimum-pairs
                                exclusion, and the (source, object) pairs of a store's prompts;
* :mod:`actstore.query.maps.projection`  the store's weights arranged to read a head's vocabulary map row by
                                row, and the ranks of targets in those rows;
* :mod:`actstore.query.maps.static`      static scores from the weights alone, salient operations, their tables,
                                and the scores an earlier run stored;
* :mod:`actstore.query.maps.dynamic`     what the heads wrote on the stored prompts, and its correlation with
                                the static scores.
"""
