package lab

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/monitor"
	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
)

// attachmentPodPrefix names KubeVirt's attachment pods (kubevirt v1.7.0
// pkg/virt-controller/services/template.go: "hp-volume-").
const attachmentPodPrefix = "hp-volume-"

// HostBreakdown is the host's part of each hot-plug, per attachment pod
// that ran: created to scheduled (Pending on a cordoned or full node),
// scheduled to every one of its Longhorn volumes attached on that host node
// (0 when they all were already), and from then to Running (the host
// kubelet's stage and publish, Longhorn's workloads-list check, the
// container start). It is inside the breakdown's KubeVirt part.
type HostBreakdown struct {
	Scheduling monitor.Percentiles `json:"pod_scheduling_seconds"`
	Attach     monitor.Percentiles `json:"host_attach_seconds"`
	Start      monitor.Percentiles `json:"pod_start_seconds"`
}

// hostPodTimes are one attachment pod's moments; Attached is zero when an
// attach of one of its volumes was not seen.
type hostPodTimes struct {
	Created, Scheduled, Attached, Running time.Time
}

// hostSplit is the host's part over the attachment pods that ran.
func hostSplit(pods []hostPodTimes) *HostBreakdown {
	var sched, attach, start []monitor.Sample
	sample := func(from, to time.Time) monitor.Sample {
		d := max(to.Sub(from), 0)
		return monitor.Sample{At: to, D: d, Seconds: d.Seconds()}
	}
	for _, p := range pods {
		if p.Running.IsZero() || p.Scheduled.IsZero() {
			continue
		}
		sched = append(sched, sample(p.Created, p.Scheduled))
		if p.Attached.IsZero() {
			continue
		}
		attached := p.Attached
		if attached.Before(p.Scheduled) {
			attached = p.Scheduled // already on that host node
		}
		attach = append(attach, sample(p.Scheduled, attached))
		start = append(start, sample(attached, p.Running))
	}
	if len(sched) == 0 {
		return nil
	}
	return &HostBreakdown{Scheduling: monitor.Summarize(sched), Attach: monitor.Summarize(attach), Start: monitor.Summarize(start)}
}

// hostPath watches the host's attachment pods and its VolumeAttachments of
// Longhorn's driver, with the times the lab saw each step (the API's own
// timestamps have whole seconds, too coarse at the lab's time scales).
type hostPath struct {
	claims corelisters.PersistentVolumeClaimLister

	mu         sync.Mutex
	attachedAt map[string]time.Time // "pv@node": first seen attached
	pods       map[string]*hostPodTimes
	ran        []hostPodTimes
}

func startHostPath(ctx context.Context, kube kubernetes.Interface) (*hostPath, error) {
	f := informers.NewSharedInformerFactory(kube, 0)
	hp := &hostPath{claims: f.Core().V1().PersistentVolumeClaims().Lister(), attachedAt: map[string]time.Time{}, pods: map[string]*hostPodTimes{}}
	_, _ = f.Storage().V1().VolumeAttachments().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { hp.va(o.(*storagev1.VolumeAttachment), false) },
		UpdateFunc: func(_, o any) { hp.va(o.(*storagev1.VolumeAttachment), false) },
		DeleteFunc: func(o any) {
			if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
				o = t.Obj
			}
			if va, ok := o.(*storagev1.VolumeAttachment); ok {
				hp.va(va, true)
			}
		},
	})
	_, _ = f.Core().V1().Pods().Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { hp.pod(o.(*corev1.Pod), false) },
		UpdateFunc: func(_, o any) { hp.pod(o.(*corev1.Pod), false) },
		DeleteFunc: func(o any) {
			if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
				o = t.Obj
			}
			if p, ok := o.(*corev1.Pod); ok {
				hp.pod(p, true)
			}
		},
	})
	f.Start(ctx.Done())
	for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return nil, fmt.Errorf("host path: %v cache did not sync", typ)
		}
	}
	return hp, nil
}

func (hp *hostPath) va(va *storagev1.VolumeAttachment, gone bool) {
	if va.Spec.Attacher != simlonghorn.DriverName || va.Spec.Source.PersistentVolumeName == nil {
		return
	}
	key := *va.Spec.Source.PersistentVolumeName + "@" + va.Spec.NodeName
	hp.mu.Lock()
	defer hp.mu.Unlock()
	switch _, seen := hp.attachedAt[key]; {
	case gone:
		delete(hp.attachedAt, key)
	case va.Status.Attached && !seen:
		hp.attachedAt[key] = time.Now()
	}
}

func (hp *hostPath) pod(p *corev1.Pod, gone bool) {
	if !strings.HasPrefix(p.Name, attachmentPodPrefix) {
		return
	}
	now := time.Now()
	key := string(p.UID)
	hp.mu.Lock()
	defer hp.mu.Unlock()
	t := hp.pods[key]
	switch {
	case gone:
		delete(hp.pods, key)
		return
	case t == nil:
		t = &hostPodTimes{Created: now}
		hp.pods[key] = t
	}
	if t.Scheduled.IsZero() && p.Spec.NodeName != "" {
		t.Scheduled = now
	}
	if t.Running.IsZero() && p.Status.Phase == corev1.PodRunning {
		t.Running = now
		t.Attached = hp.lastAttachLocked(p)
		hp.ran = append(hp.ran, *t)
	}
}

// lastAttachLocked is when the last of the pod's volumes was seen attached
// on its node (zero when one was not).
func (hp *hostPath) lastAttachLocked(p *corev1.Pod) time.Time {
	var last time.Time
	for _, v := range p.Spec.Volumes {
		if v.PersistentVolumeClaim == nil {
			continue
		}
		c, err := hp.claims.PersistentVolumeClaims(p.Namespace).Get(v.PersistentVolumeClaim.ClaimName)
		if err != nil || c.Spec.VolumeName == "" {
			return time.Time{}
		}
		at, ok := hp.attachedAt[c.Spec.VolumeName+"@"+p.Spec.NodeName]
		if !ok {
			return time.Time{}
		}
		if at.After(last) {
			last = at
		}
	}
	return last
}

// breakdown is the host's part of the attachment pods that ran so far.
func (hp *hostPath) breakdown() *HostBreakdown {
	if hp == nil {
		return nil
	}
	hp.mu.Lock()
	defer hp.mu.Unlock()
	return hostSplit(hp.ran)
}
