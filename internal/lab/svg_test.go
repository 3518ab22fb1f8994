package lab

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/monitor"
)

func TestLatencySVGDrawsBothSeries(t *testing.T) {
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	rep := &Report{Started: start, Config: Config{KubeVirt: KubeVirtLegacyV15, TimeScale: 1}}
	for i := range 20 {
		rep.AttachSamples = append(rep.AttachSamples, monitor.Sample{At: start.Add(time.Duration(i) * time.Second), Seconds: float64(i % 7)})
		rep.DetachSamples = append(rep.DetachSamples, monitor.Sample{At: start.Add(time.Duration(i)*time.Second + 500*time.Millisecond), Seconds: 1})
		rep.InFlight = append(rep.InFlight, InFlight{Seconds: float64(i), Attaching: i % 3, Detaching: i % 2})
	}
	path := filepath.Join(t.TempDir(), "latency.svg")
	if err := writeLatencySVG(path, rep); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	svg := string(data)
	for _, want := range []string{"<svg", "attach (created", "detach (deleted", "attaching", "in flight"} {
		if !strings.Contains(svg, want) {
			t.Errorf("latency.svg lacks %q", want)
		}
	}
}

// The in-flight axis counts VolumeAttachments: whole numbers only, over
// small and large ranges.
func TestInFlightAxisHasWholeNumbers(t *testing.T) {
	for _, r := range [][2]float64{{0, 2.6}, {0, 3}, {0, 47.3}, {1, 1}} {
		ticks := wholeTicks{}.Ticks(r[0], r[1])
		if len(ticks) == 0 {
			t.Errorf("%v: no ticks", r)
		}
		for _, tk := range ticks {
			if tk.Value != math.Trunc(tk.Value) || strings.Contains(tk.Label, ".") {
				t.Errorf("%v: tick %v %q is not a whole number", r, tk.Value, tk.Label)
			}
		}
	}
}

// --compare draws both runs in one figure: each run's attach and detach
// series and both in-flight lines, with the fonts embedded so the legend
// is laid out as measured.
func TestCompareSVGDrawsBothRuns(t *testing.T) {
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	mk := func(bin string) *Report {
		rep := &Report{Started: start, Config: Config{KubeVirt: KubeVirtDeclarative}, Driver: Driver{Binary: bin}}
		for i := range 10 {
			rep.AttachSamples = append(rep.AttachSamples, monitor.Sample{At: start.Add(time.Duration(i) * time.Second), Seconds: float64(i)})
			rep.DetachSamples = append(rep.DetachSamples, monitor.Sample{At: start.Add(time.Duration(i) * time.Second), Seconds: 1})
			rep.InFlight = append(rep.InFlight, InFlight{Seconds: float64(i), Attaching: i % 3})
		}
		return rep
	}
	path := filepath.Join(t.TempDir(), "compare.svg")
	if err := WriteCompareSVG(path, mk("/bin/harvester-csi-driver"), mk("/bin/upstream-v0.2.9")); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	svg := string(data)
	for _, want := range []string{"this driver: attach", "compared: attach", "this driver: detach", "compared: detach",
		"compared: attaching + detaching", "upstream-v0.2.9", "@font-face"} {
		if !strings.Contains(svg, want) {
			t.Errorf("compare.svg lacks %q", want)
		}
	}
}
