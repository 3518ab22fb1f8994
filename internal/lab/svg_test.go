package lab

import (
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
