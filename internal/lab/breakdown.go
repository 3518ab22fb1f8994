package lab

import (
	"bufio"
	"io"
	"os"
	"regexp"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/monitor"
)

// Breakdown splits the driver's own time per completed hotplug intent, from
// its controller log's "intent done" lines: the part its queue held the
// change (the batch window, KubeVirt settling the VM's previous change) and
// the part KubeVirt took after the change was written. A controller that
// writes no such lines (another driver under --controller-binary) leaves it
// empty.
type Breakdown struct {
	AttachHeld monitor.Percentiles `json:"attach_held_seconds"`
	AttachHost monitor.Percentiles `json:"attach_kubevirt_seconds"`
	DetachHeld monitor.Percentiles `json:"detach_held_seconds"`
	DetachHost monitor.Percentiles `json:"detach_kubevirt_seconds"`
	// Host is the host's part inside KubeVirt's, with host nodes.
	Host *HostBreakdown `json:"host,omitempty"`
}

// withHost adds the host's part to the controller's split; a controller
// that logs no split still gets the host's part.
func withHost(bd *Breakdown, host *HostBreakdown) *Breakdown {
	if host == nil {
		return bd
	}
	if bd == nil {
		bd = &Breakdown{}
	}
	bd.Host = host
	return bd
}

var intentDone = regexp.MustCompile(`"intent done" .*\bop="(attach|detach)" err=null .*\bheld="([^"]+)" host="([^"]+)"`)

// readBreakdown reads a controller log; a missing log is an empty breakdown.
func readBreakdown(path string) (*Breakdown, error) {
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return parseBreakdown(f)
}

func parseBreakdown(r io.Reader) (*Breakdown, error) {
	var held, host [2][]monitor.Sample // attach, detach
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		m := intentDone.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		h, err1 := time.ParseDuration(m[2])
		k, err2 := time.ParseDuration(m[3])
		if err1 != nil || err2 != nil {
			continue
		}
		i := 0
		if m[1] == "detach" {
			i = 1
		}
		held[i] = append(held[i], monitor.Sample{Seconds: h.Seconds()})
		host[i] = append(host[i], monitor.Sample{Seconds: k.Seconds()})
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(held[0])+len(held[1]) == 0 {
		return nil, nil
	}
	return &Breakdown{
		AttachHeld: monitor.Summarize(held[0]), AttachHost: monitor.Summarize(host[0]),
		DetachHeld: monitor.Summarize(held[1]), DetachHost: monitor.Summarize(host[1]),
	}, nil
}
