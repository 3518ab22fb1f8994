// Package percentile is the one definition of a percentile behind every
// latency figure docs/benchmarks.md quotes (the churn and scale benchmarks and
// the lab's reports), so figures from different tools can be compared.
package percentile

import "math"

// Nearest is the p-th percentile (0 < p <= 1) of sorted by nearest rank: the
// smallest sample that at least p of all samples are at or below. It always
// answers a measured value, never an interpolation between two, and 0 for no
// samples.
func Nearest(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}
