package percentile

import "testing"

func TestNearestRank(t *testing.T) {
	ten := []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	for _, c := range []struct {
		xs   []float64
		p    float64
		want float64
	}{
		{ten, 0.5, 5}, // half the samples are at or below 5, not 6
		{ten, 0.95, 10},
		{ten, 0.1, 1},
		{ten, 0.11, 2},
		{ten, 1, 10},
		{[]float64{7}, 0.5, 7},
		{nil, 0.99, 0},
	} {
		if got := Nearest(c.xs, c.p); got != c.want {
			t.Errorf("Nearest(%v, %v) = %v, want %v", c.xs, c.p, got, c.want)
		}
	}
}
