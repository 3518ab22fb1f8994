package lab

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"k8s.io/klog/v2/textlogger"
)

// TestBreakdownReadsTheControllersIntentLines: the lab's split of the
// controller's time comes from its "intent done" lines as klog writes them;
// failed intents and other lines are left out.
func TestBreakdownReadsTheControllersIntentLines(t *testing.T) {
	var buf bytes.Buffer
	logger := textlogger.NewLogger(textlogger.NewConfig(textlogger.Output(&buf), textlogger.Verbosity(4)))
	done := func(op string, err error, held, host time.Duration) {
		logger.V(2).Info("intent done", "volume", "pvc-1", "op", op, "err", err, "after", held+host, "held", held, "host", host)
	}
	done("attach", nil, 200*time.Millisecond, 10*time.Second)
	done("attach", nil, 9*time.Second, 11*time.Second)
	done("attach", errors.New("refused"), 30*time.Second, 0)
	done("detach", nil, 1500*time.Millisecond, 8*time.Second)
	buf.WriteString(`I1123 19:27:28.738741    4527 sync.go:166] "applying hotplug changes" vm="node-2" backend="declarative" changes=["attach:pvc-c6bb"] attempt=0` + "\n")
	bd, err := parseBreakdown(strings.NewReader(buf.String()))
	if err != nil {
		t.Fatal(err)
	}
	if bd == nil {
		t.Fatalf("no breakdown from:\n%s", buf.String())
	}
	if bd.AttachHeld.N != 2 || bd.AttachHeld.Max != 9 || bd.AttachHost.Max != 11 {
		t.Errorf("attach: held %+v, KubeVirt %+v; want 2 samples, held max 9 s, KubeVirt max 11 s", bd.AttachHeld, bd.AttachHost)
	}
	if bd.DetachHeld.N != 1 || bd.DetachHeld.Max != 1.5 || bd.DetachHost.Max != 8 {
		t.Errorf("detach: held %+v, KubeVirt %+v; want one sample of 1.5 s and 8 s", bd.DetachHeld, bd.DetachHost)
	}
}

func TestBreakdownOfAControllerThatDoesNotLogIt(t *testing.T) {
	bd, err := parseBreakdown(strings.NewReader("I1123 12:00:00.000000 1 main.go:1] \"ControllerPublishVolume\" volume=\"pvc-1\"\n"))
	if err != nil || bd != nil {
		t.Errorf("got %+v, %v; want nothing", bd, err)
	}
}
