package lab

import (
	"context"
	"slices"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/monitor"
	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
)

// Cases of an attach or detach, by where the host had the volume when the
// guest VolumeAttachment appeared (an attach; the driver's publish follows
// at once) or was deleted (a detach).
const (
	// CaseOnHostNode: the host had the volume on the VM's host node only
	// (for an attach: already there; for a detach, the usual case).
	CaseOnHostNode = "on-host-node"
	// CaseFresh: the host had it on no host node: a Longhorn attach first.
	CaseFresh = "fresh"
	// CaseMoved: the host still had it on another host node: that node
	// must let go first (or Longhorn migrates it).
	CaseMoved = "moved"
)

// caseTitles are the cases in report order, with their titles.
var caseTitles = []struct{ key, title string }{
	{CaseOnHostNode, "already on that host node"},
	{CaseFresh, "attached fresh"},
	{CaseMoved, "moved between host nodes"},
	{"", "not classified"},
}

// hostCase classifies by the VM's host node and the host nodes where the
// host holds the volume (Longhorn's engines, host VolumeAttachments). ""
// when the VM's host node is unknown.
func hostCase(vmHost string, held []string) string {
	if vmHost == "" {
		return ""
	}
	for _, n := range held {
		if n != vmHost {
			return CaseMoved
		}
	}
	if slices.Contains(held, vmHost) {
		return CaseOnHostNode
	}
	return CaseFresh
}

// classifyTimeout bounds the classifier's reads: the monitor's handler waits
// for them, and a paused host API server (--pause-api-for) must not hold
// back the guest's latency figures for longer.
const classifyTimeout = 2 * time.Second

// classifier names the case of each guest attach and detach from the host's
// state when it starts: guest PV → host claim (its volume handle) → host
// PV (the Longhorn volume) → where Longhorn runs it and which host nodes
// have a VolumeAttachment of it; against the host node of the VM (the
// guest node).
func (r *run) classifier(runCtx context.Context) monitor.Classifier {
	return func(va *storagev1.VolumeAttachment, _ bool) string {
		ctx, cancel := context.WithTimeout(runCtx, classifyTimeout)
		defer cancel()
		if va.Spec.Source.PersistentVolumeName == nil {
			return ""
		}
		pv, err := r.g.Kube.CoreV1().PersistentVolumes().Get(ctx, *va.Spec.Source.PersistentVolumeName, metav1.GetOptions{})
		if err != nil || pv.Spec.CSI == nil {
			return ""
		}
		claim, err := r.h.Kube.CoreV1().PersistentVolumeClaims(r.h.Namespace).Get(ctx, pv.Spec.CSI.VolumeHandle, metav1.GetOptions{})
		if err != nil || claim.Spec.VolumeName == "" {
			return ""
		}
		held, err := r.hostHeld(ctx, claim.Spec.VolumeName)
		if err != nil {
			r.log.V(2).Info("host state not read, attach or detach not classified", "volume", claim.Spec.VolumeName, "err", err)
			return ""
		}
		return hostCase(r.h.HostNodeOf(ctx, va.Spec.NodeName), held)
	}
}

// hostHeld lists the host nodes that hold a Longhorn volume: its engines
// and its host VolumeAttachments, attached or not yet detached.
func (r *run) hostHeld(ctx context.Context, volume string) ([]string, error) {
	v, err := r.h.Longhorn.Volume(ctx, volume)
	if err != nil {
		return nil, err
	}
	var held []string
	for _, n := range []string{v.Status.CurrentNodeID, v.Status.CurrentMigrationNodeID} {
		if n != "" {
			held = append(held, n)
		}
	}
	vas, err := r.h.Kube.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	for _, va := range vas.Items {
		if va.Spec.Attacher == simlonghorn.DriverName && va.Spec.Source.PersistentVolumeName != nil &&
			*va.Spec.Source.PersistentVolumeName == volume && !slices.Contains(held, va.Spec.NodeName) {
			held = append(held, va.Spec.NodeName)
		}
	}
	return held, nil
}

// CaseLatency is the latency of one case.
type CaseLatency struct {
	Case  string `json:"case"`
	Title string `json:"title"`
	Count int    `json:"count"`
	// Share of the run's operations of that kind, 0 to 1.
	Share   float64             `json:"share"`
	Latency monitor.Percentiles `json:"latency_seconds"`
}

// byCase splits samples by their case, in report order; nil when no sample
// has one (a run without host nodes).
func byCase(samples []monitor.Sample) []CaseLatency {
	if !slices.ContainsFunc(samples, func(s monitor.Sample) bool { return s.Case != "" }) {
		return nil
	}
	var out []CaseLatency
	for _, c := range caseTitles {
		var in []monitor.Sample
		for _, s := range samples {
			if s.Case == c.key {
				in = append(in, s)
			}
		}
		if len(in) == 0 {
			continue
		}
		out = append(out, CaseLatency{Case: c.key, Title: c.title, Count: len(in),
			Share: float64(len(in)) / float64(len(samples)), Latency: monitor.Summarize(in)})
	}
	return out
}
