package lab

import (
	"strings"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/monitor"
)

// Each column of the comparison holds its own report's figures, and an
// attacher error seen by only one side shows 0 on the other.
func TestCompareColumns(t *testing.T) {
	a := &Report{Passed: true, Stuck: 0, Operations: Operations{Attaches: 120, Detaches: 118, JobsRun: 200, Expansions: 5},
		AttachLatency:  monitor.Percentiles{P50: 11.04, P95: 14.2, P99: 19.96},
		KubeVirtWrites: KubeVirtWrites{PerVolumeOp: 0.43}, Conflicts: map[string]int{"409": 0, "422": 0},
		AttacherErrors: map[string]int{}, Driver: Driver{Binary: "/bin/this"},
		Config: Config{ExpandEvery: time.Second}, ExpandLatency: monitor.Percentiles{P50: 3.04}, DataChecks: DataChecks{Passed: 102}}
	b := &Report{Passed: false, Stuck: 3, Operations: Operations{Attaches: 80, Detaches: 77, JobsRun: 136, Expansions: 1},
		AttachLatency:  monitor.Percentiles{P50: 81.4, P95: 120.5, P99: 144.8},
		KubeVirtWrites: KubeVirtWrites{PerVolumeOp: 1.52}, Conflicts: map[string]int{"409": 17, "422": 4},
		AttacherErrors: map[string]int{"rpc error: code = Internal desc = removal in progress": 196}, Driver: Driver{Binary: "/bin/upstream"},
		ExpandLatency: monitor.Percentiles{P50: 77}, DataChecks: DataChecks{Passed: 46, Failed: 1}}
	out := Compare(a, b)
	row := func(name string) string {
		for _, l := range strings.Split(out, "\n") {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(l), name); ok {
				return strings.Join(strings.Fields(rest), " ")
			}
		}
		t.Errorf("no row %q in:\n%s", name, out)
		return ""
	}
	for name, want := range map[string]string{
		"controller binary":                   "/bin/this /bin/upstream",
		"passed":                              "true false",
		"stuck":                               "0 3",
		"attaches / detaches":                 "120 / 118 80 / 77",
		"jobs run":                            "200 136",
		"attach (VA created -> attached) p50": "11.0s 81.4s",
		"p99":                                 "20.0s 144.8s",
		"KubeVirt writes per volume op":       "0.43 1.52",
		"409 conflicts":                       "0 17",
		"422 unprocessable":                   "0 4",
		"claim expansions / p50":              "5 / 3.0s 1 / 77.0s",
		"data checks passed / failed":         "102 / 0 46 / 1",
		"0 / 196":                             "rpc error: code = Internal desc = removal in progress",
	} {
		if got := row(name); got != want {
			t.Errorf("row %q = %q, want %q", name, got, want)
		}
	}
}
