from megarl.utils.bucketing import buckets_by_size


def test_buckets_keep_order_and_the_limit():
    sized = [("a", 3), ("b", 4), ("c", 2), ("d", 7), ("e", 1)]
    assert list(buckets_by_size(iter(sized), 7)) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert list(buckets_by_size(iter(sized), 100)) == [["a", "b", "c", "d", "e"]]


def test_an_item_over_the_limit_is_a_bucket_alone():
    assert list(buckets_by_size([("x", 1), ("big", 10), ("y", 1)], 4)) == [["x"], ["big"], ["y"]]
    assert list(buckets_by_size([], 4)) == []


def test_consumes_lazily():
    taken = []

    def items():
        for name in "abcd":
            taken.append(name)
            yield name, 2

    buckets = buckets_by_size(items(), 4)
    assert next(buckets) == ["a", "b"] and taken == ["a", "b", "c"]  # the bucket is whole once "c" does not fit
