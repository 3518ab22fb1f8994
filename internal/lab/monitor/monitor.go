// Package monitor watches the guest cluster the way an operator would: every
// VolumeAttachment from creation to attached=true and from deletion to gone,
// every pod from creation to Running, every Job's end, and the errors the
// external-attacher writes into VolumeAttachments. It keeps the latency
// samples and counters of the lab's report and lists what is in progress for
// the stuck checker.
package monitor

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/harvester-csi/harvester-csi-driver/internal/percentile"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/invariants"
)

// volumeID matches the volume IDs in messages, so the same error on
// different volumes counts as one kind.
var volumeID = regexp.MustCompile(`pvc-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`)

// Sample is one latency measurement.
type Sample struct {
	At      time.Time     `json:"at"`
	Seconds float64       `json:"seconds"`
	D       time.Duration `json:"-"`
	// Case is what the Classifier named the operation when it started.
	Case string `json:"case,omitempty"`
}

// Classifier names the case of a VolumeAttachment's attach (detach false)
// when it is first seen, or of its detach when its deletion is first seen;
// "" leaves it unnamed. It may read an API server: the monitor calls it
// outside its lock.
type Classifier func(va *storagev1.VolumeAttachment, detach bool) string

// Monitor is a running monitor.
type Monitor struct {
	mu sync.Mutex

	vaCreated  map[string]time.Time
	vaAttached map[string]bool
	vaDeleting map[string]time.Time
	vaInfo     map[string]invariants.Pair
	vaErr      map[string]string
	// vaCase and vaDetachCase: the Classifier's case of each
	// VolumeAttachment's attach and detach.
	vaCase, vaDetachCase map[string]string
	classify             Classifier

	podCreated   map[string]time.Time
	podScheduled map[string]time.Time
	podRunning   map[string]bool
	podInfo      map[string]podInfo

	jobsDone map[string]bool

	Attach, Detach, PodStart []Sample
	AttacherErrors           map[string]int
	JobsSucceeded            int
	JobsFailed               int
	Attaches, Detaches       int

	factory informers.SharedInformerFactory
}

type podInfo struct {
	node    string
	volumes []string // claim names
}

// Start starts watching.
func Start(ctx context.Context, kube kubernetes.Interface) (*Monitor, error) {
	return StartClassified(ctx, kube, nil)
}

// StartClassified starts watching, each attach and detach sample carrying
// the case classify names when the operation starts.
func StartClassified(ctx context.Context, kube kubernetes.Interface, classify Classifier) (*Monitor, error) {
	m := &Monitor{
		vaCreated: map[string]time.Time{}, vaAttached: map[string]bool{}, vaDeleting: map[string]time.Time{},
		vaInfo: map[string]invariants.Pair{}, vaErr: map[string]string{},
		vaCase: map[string]string{}, vaDetachCase: map[string]string{}, classify: classify,
		podCreated: map[string]time.Time{}, podScheduled: map[string]time.Time{}, podRunning: map[string]bool{},
		podInfo: map[string]podInfo{}, jobsDone: map[string]bool{}, AttacherErrors: map[string]int{},
	}
	m.factory = informers.NewSharedInformerFactory(kube, 0)
	vaInf := m.factory.Storage().V1().VolumeAttachments().Informer()
	podInf := m.factory.Core().V1().Pods().Informer()
	jobInf := m.factory.Batch().V1().Jobs().Informer()
	_, _ = vaInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { m.va(o.(*storagev1.VolumeAttachment), false) },
		UpdateFunc: func(_, o any) { m.va(o.(*storagev1.VolumeAttachment), false) },
		DeleteFunc: func(o any) {
			if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
				o = t.Obj
			}
			if va, ok := o.(*storagev1.VolumeAttachment); ok {
				m.va(va, true)
			}
		},
	})
	_, _ = podInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { m.pod(o.(*corev1.Pod), false) },
		UpdateFunc: func(_, o any) { m.pod(o.(*corev1.Pod), false) },
		DeleteFunc: func(o any) {
			if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
				o = t.Obj
			}
			if p, ok := o.(*corev1.Pod); ok {
				m.pod(p, true)
			}
		},
	})
	_, _ = jobInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { m.job(o.(*batchv1.Job)) },
		UpdateFunc: func(_, o any) { m.job(o.(*batchv1.Job)) },
	})
	m.factory.Start(ctx.Done())
	for typ, ok := range m.factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return nil, fmt.Errorf("monitor: %v cache did not sync", typ)
		}
	}
	return m, nil
}

// classifyVA names the case of an attach when its VolumeAttachment first
// appears and of a detach when its deletion is first seen. The informer
// calls its handlers one at a time, so no other event of the same
// VolumeAttachment comes between the look and the store.
func (m *Monitor) classifyVA(va *storagev1.VolumeAttachment, gone bool) {
	if m.classify == nil || gone {
		return
	}
	m.mu.Lock()
	_, seen := m.vaCreated[va.Name]
	_, deleting := m.vaDeleting[va.Name]
	m.mu.Unlock()
	detach := va.DeletionTimestamp != nil
	if (detach && deleting) || (!detach && seen) {
		return
	}
	c := m.classify(va, detach)
	m.mu.Lock()
	if detach {
		m.vaDetachCase[va.Name] = c
	} else {
		m.vaCase[va.Name] = c
	}
	m.mu.Unlock()
}

func (m *Monitor) va(va *storagev1.VolumeAttachment, gone bool) {
	now := time.Now() // before the classifier's reads
	m.classifyVA(va, gone)
	m.mu.Lock()
	defer m.mu.Unlock()
	name := va.Name
	if _, ok := m.vaCreated[name]; !ok && !gone {
		m.vaCreated[name] = va.CreationTimestamp.Time
		if va.CreationTimestamp.IsZero() {
			m.vaCreated[name] = now
		}
	}
	vol := ""
	if va.Spec.Source.PersistentVolumeName != nil {
		vol = *va.Spec.Source.PersistentVolumeName
	}
	m.vaInfo[name] = invariants.Pair{Node: va.Spec.NodeName, Volume: vol}
	if va.Status.Attached && !m.vaAttached[name] && va.DeletionTimestamp == nil {
		m.vaAttached[name] = true
		m.Attaches++
		d := now.Sub(m.vaCreated[name])
		m.Attach = append(m.Attach, Sample{At: now, D: d, Seconds: d.Seconds(), Case: m.vaCase[name]})
	}
	for _, e := range []*storagev1.VolumeError{va.Status.AttachError, va.Status.DetachError} {
		if e != nil && e.Message != "" && m.vaErr[name] != e.Message {
			m.vaErr[name] = e.Message
			m.AttacherErrors[volumeID.ReplaceAllString(e.Message, "<volume>")]++
		}
	}
	if va.DeletionTimestamp != nil {
		if _, ok := m.vaDeleting[name]; !ok {
			m.vaDeleting[name] = va.DeletionTimestamp.Time
		}
	}
	if gone {
		if since, ok := m.vaDeleting[name]; ok {
			m.Detaches++
			d := now.Sub(since)
			m.Detach = append(m.Detach, Sample{At: now, D: d, Seconds: d.Seconds(), Case: m.vaDetachCase[name]})
		}
		delete(m.vaCreated, name)
		delete(m.vaCase, name)
		delete(m.vaDetachCase, name)
		delete(m.vaAttached, name)
		delete(m.vaDeleting, name)
		delete(m.vaInfo, name)
		delete(m.vaErr, name)
	}
}

func (m *Monitor) pod(p *corev1.Pod, gone bool) {
	now := time.Now()
	key := p.Namespace + "/" + p.Name + "/" + string(p.UID)
	m.mu.Lock()
	defer m.mu.Unlock()
	if gone {
		delete(m.podCreated, key)
		delete(m.podScheduled, key)
		delete(m.podRunning, key)
		delete(m.podInfo, key)
		return
	}
	if _, ok := m.podCreated[key]; !ok {
		m.podCreated[key] = p.CreationTimestamp.Time
	}
	var claims []string
	for _, v := range p.Spec.Volumes {
		if v.PersistentVolumeClaim != nil {
			claims = append(claims, p.Namespace+"/"+v.PersistentVolumeClaim.ClaimName)
		}
	}
	m.podInfo[key] = podInfo{node: p.Spec.NodeName, volumes: claims}
	if p.Spec.NodeName != "" {
		if _, ok := m.podScheduled[key]; !ok {
			m.podScheduled[key] = now
		}
	}
	if !m.podRunning[key] && p.Status.Phase == corev1.PodFailed {
		m.podRunning[key] = true // ended without running: not waiting for volumes any more
	}
	if !m.podRunning[key] && (p.Status.Phase == corev1.PodRunning || p.Status.Phase == corev1.PodSucceeded) {
		m.podRunning[key] = true
		d := now.Sub(m.podCreated[key])
		m.PodStart = append(m.PodStart, Sample{At: now, D: d, Seconds: d.Seconds()})
	}
}

func (m *Monitor) job(j *batchv1.Job) {
	m.mu.Lock()
	defer m.mu.Unlock()
	key := j.Namespace + "/" + j.Name
	if m.jobsDone[key] {
		return
	}
	for _, c := range j.Status.Conditions {
		if c.Status != corev1.ConditionTrue {
			continue
		}
		switch c.Type {
		case batchv1.JobComplete:
			m.jobsDone[key] = true
			m.JobsSucceeded++
		case batchv1.JobFailed:
			m.jobsDone[key] = true
			m.JobsFailed++
		}
	}
}

// Snapshot is a consistent copy of the figures.
type Snapshot struct {
	Attach, Detach, PodStart []Sample
	AttacherErrors           map[string]int
	JobsSucceeded            int
	JobsFailed               int
	Attaches, Detaches       int
	// InFlight: VolumeAttachments attaching or detaching now.
	Attaching, Detaching int
}

// Snapshot copies the figures.
func (m *Monitor) Snapshot() Snapshot {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := Snapshot{
		Attach: slices.Clone(m.Attach), Detach: slices.Clone(m.Detach), PodStart: slices.Clone(m.PodStart),
		AttacherErrors: map[string]int{}, JobsSucceeded: m.JobsSucceeded, JobsFailed: m.JobsFailed,
		Attaches: m.Attaches, Detaches: m.Detaches,
	}
	for k, v := range m.AttacherErrors {
		s.AttacherErrors[k] = v
	}
	for name := range m.vaCreated {
		if _, del := m.vaDeleting[name]; del {
			s.Detaching++
		} else if !m.vaAttached[name] {
			s.Attaching++
		}
	}
	return s
}

// Pending lists what is in progress: attaching and detaching
// VolumeAttachments, and pods bound to a node that are not running yet.
func (m *Monitor) Pending() []invariants.Pending {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []invariants.Pending
	for name, created := range m.vaCreated {
		info := m.vaInfo[name]
		if since, del := m.vaDeleting[name]; del {
			out = append(out, invariants.Pending{What: "detach", Name: name, Volume: info.Volume, Node: info.Node, Since: since})
		} else if !m.vaAttached[name] {
			out = append(out, invariants.Pending{What: "attach", Name: name, Volume: info.Volume, Node: info.Node, Since: created})
		}
	}
	for key, sched := range m.podScheduled {
		if m.podRunning[key] {
			continue
		}
		info := m.podInfo[key]
		if len(info.volumes) == 0 {
			continue
		}
		out = append(out, invariants.Pending{What: "pod", Name: key, Volume: fmt.Sprint(info.volumes), Node: info.node, Since: sched})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Since.Before(out[j].Since) })
	return out
}

// NeverStarted lists the pods with claims that were created before cutoff
// and have not run (nor ended) since: pods the workload wanted that never
// got their volumes.
func (m *Monitor) NeverStarted(cutoff time.Time) []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for key, created := range m.podCreated {
		if m.podRunning[key] || !created.Before(cutoff) || len(m.podInfo[key].volumes) == 0 {
			continue
		}
		ns, rest, _ := strings.Cut(key, "/")
		name, _, _ := strings.Cut(rest, "/")
		out = append(out, ns+"/"+name)
	}
	sort.Strings(out)
	return out
}

// Percentiles of samples.
type Percentiles struct {
	P50 float64 `json:"p50"`
	P95 float64 `json:"p95"`
	P99 float64 `json:"p99"`
	Max float64 `json:"max"`
	N   int     `json:"n"`
}

// Summarize computes percentiles (seconds) of samples.
func Summarize(samples []Sample) Percentiles {
	if len(samples) == 0 {
		return Percentiles{}
	}
	v := make([]float64, len(samples))
	for i, s := range samples {
		v[i] = s.Seconds
	}
	sort.Float64s(v)
	q := func(p float64) float64 { return percentile.Nearest(v, p) }
	return Percentiles{P50: q(0.50), P95: q(0.95), P99: q(0.99), Max: v[len(v)-1], N: len(v)}
}
