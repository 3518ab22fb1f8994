// Package workload makes the lab's guest workload, that of Harvester issue
// 9761: per namespace a database StatefulSet (1 replica, 1Gi RWO claim) and a
// backup CronJob (`*/1 * * * *`, concurrencyPolicy Forbid) whose Job mounts a
// second RWO claim; it moves databases between nodes now and then, and at the
// end suspends the CronJobs and deletes everything.
package workload

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// Options shape the workload.
type Options struct {
	Namespaces   int
	Nodes        []string
	StorageClass string
	// DBStorageClass is the databases' class (default StorageClass).
	DBStorageClass string
	// Image is the agent's image (the hollow kubelet runs the agent for it).
	Image string
	// DBInterval is how often a database writes a record.
	DBInterval time.Duration
	// BackupWork is how long a backup run works.
	BackupWork time.Duration
	// LabJobs: the lab creates a backup Job in each namespace every
	// JobInterval (when the last one has finished) instead of a CronJob.
	LabJobs     bool
	JobInterval time.Duration
	// MoveInterval is how often one database is moved to another node (0:
	// never).
	MoveInterval time.Duration
	// ExpandInterval is how often one database's claim is expanded by
	// ExpandStep (0: never); an expansion not done within ExpandTimeout is
	// reported failed. OnExpansion hears of every expansion's end.
	ExpandInterval time.Duration
	ExpandStep     resource.Quantity
	ExpandTimeout  time.Duration
	OnExpansion    func(Expansion)
	Seed           uint64
}

// Expansion is one claim expansion the workload asked for.
type Expansion struct {
	Namespace, Claim string
	// Node is where the claim's pod ran when the expansion was asked for
	// (the expansion is online).
	Node      string
	From, To  resource.Quantity
	Requested time.Time
	// Done is when the claim reported the new size with no resize pending;
	// Err says why it did not.
	Done time.Time
	Err  error
}

// Workload drives the workload on the guest.
type Workload struct {
	kube kubernetes.Interface
	o    Options
	rnd  *rand.Rand

	mu    sync.Mutex
	moves int
	jobs  int // Jobs the lab created (LabJobs)
}

// New prepares a workload.
func New(kube kubernetes.Interface, o Options) *Workload {
	return &Workload{kube: kube, o: o, rnd: rand.New(rand.NewPCG(o.Seed, o.Seed+1))}
}

// Namespace is the name of workload namespace i.
func Namespace(i int) string { return fmt.Sprintf("lab-%02d", i) }

// Namespaces lists the workload's namespaces.
func (w *Workload) Namespaces() []string {
	out := make([]string, w.o.Namespaces)
	for i := range out {
		out[i] = Namespace(i)
	}
	return out
}

func claim(name, class string) corev1.PersistentVolumeClaimSpec {
	return corev1.PersistentVolumeClaimSpec{
		AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
		StorageClassName: ptr.To(class),
		Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
	}
}

func (w *Workload) backupPod() corev1.PodTemplateSpec {
	return corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "backup"}},
		Spec: corev1.PodSpec{
			RestartPolicy:                 corev1.RestartPolicyNever,
			TerminationGracePeriodSeconds: ptr.To[int64](10),
			Containers: []corev1.Container{{
				Name: "backup", Image: w.o.Image, ImagePullPolicy: corev1.PullIfNotPresent,
				Args:         []string{"backup", "--path=/backup", "--work=" + w.o.BackupWork.String()},
				VolumeMounts: []corev1.VolumeMount{{Name: "backup", MountPath: "/backup"}},
			}},
			Volumes: []corev1.Volume{{Name: "backup", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "backup"}}}},
		},
	}
}

// Create makes every namespace with its claim, StatefulSet and CronJob.
func (w *Workload) Create(ctx context.Context) error {
	for _, ns := range w.Namespaces() {
		if err := w.create(ctx, ns); err != nil {
			return fmt.Errorf("namespace %s: %w", ns, err)
		}
	}
	return nil
}

func ignoreExists(err error) error {
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	return err
}

func (w *Workload) create(ctx context.Context, ns string) error {
	c := w.kube
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns, Labels: map[string]string{"hcsi-lab": "workload"}}}, metav1.CreateOptions{}); ignoreExists(err) != nil {
		return err
	}
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "backup"}, Spec: claim("backup", w.o.StorageClass)}, metav1.CreateOptions{}); ignoreExists(err) != nil {
		return err
	}
	labels := map[string]string{"app": "db"}
	sts := &appsv1.StatefulSet{
		ObjectMeta: metav1.ObjectMeta{Name: "db"},
		Spec: appsv1.StatefulSetSpec{
			Replicas:    ptr.To[int32](1),
			ServiceName: "db",
			Selector:    &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					TerminationGracePeriodSeconds: ptr.To[int64](10),
					Containers: []corev1.Container{{
						Name: "db", Image: w.o.Image, ImagePullPolicy: corev1.PullIfNotPresent,
						Args:         []string{"db", "--path=/data", "--interval=" + w.o.DBInterval.String()},
						VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/data"}},
					}},
				},
			},
			VolumeClaimTemplates: []corev1.PersistentVolumeClaim{{ObjectMeta: metav1.ObjectMeta{Name: "data"}, Spec: claim("data", cmp.Or(w.o.DBStorageClass, w.o.StorageClass))}},
			PersistentVolumeClaimRetentionPolicy: &appsv1.StatefulSetPersistentVolumeClaimRetentionPolicy{
				WhenDeleted: appsv1.DeletePersistentVolumeClaimRetentionPolicyType,
				WhenScaled:  appsv1.RetainPersistentVolumeClaimRetentionPolicyType,
			},
		},
	}
	if _, err := c.AppsV1().StatefulSets(ns).Create(ctx, sts, metav1.CreateOptions{}); ignoreExists(err) != nil {
		return err
	}
	if w.o.LabJobs {
		return nil
	}
	cj := &batchv1.CronJob{
		ObjectMeta: metav1.ObjectMeta{Name: "backup"},
		Spec: batchv1.CronJobSpec{
			Schedule:          "*/1 * * * *",
			ConcurrencyPolicy: batchv1.ForbidConcurrent,
			JobTemplate: batchv1.JobTemplateSpec{Spec: batchv1.JobSpec{
				BackoffLimit: ptr.To[int32](2),
				Template:     w.backupPod(),
			}},
		},
	}
	if _, err := c.BatchV1().CronJobs(ns).Create(ctx, cj, metav1.CreateOptions{}); ignoreExists(err) != nil {
		return err
	}
	return nil
}

// Run drives the workload until ctx ends: lab-made Jobs (LabJobs) and
// database moves.
func (w *Workload) Run(ctx context.Context) { w.RunUntil(ctx, ctx) }

// RunUntil is Run where an expansion still under way when ctx ends is
// followed until it ends or lifetime does: one asked for near the end is
// judged too.
func (w *Workload) RunUntil(ctx, lifetime context.Context) {
	var wg sync.WaitGroup
	if w.o.LabJobs {
		for _, ns := range w.Namespaces() {
			wg.Add(1)
			go func() {
				defer wg.Done()
				w.jobLoop(ctx, ns)
			}()
		}
	}
	if w.o.MoveInterval > 0 && len(w.o.Nodes) > 1 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.moveLoop(ctx)
		}()
	}
	if w.o.ExpandInterval > 0 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.expandLoop(ctx, lifetime)
		}()
	}
	wg.Wait()
}

// jobLoop creates a backup Job whenever the namespace has none running and
// JobInterval has passed, keeping the last two finished ones, like a
// CronJob with concurrencyPolicy Forbid on a faster clock.
func (w *Workload) jobLoop(ctx context.Context, ns string) {
	logger := klog.FromContext(ctx).WithValues("namespace", ns)
	n := 0
	w.mu.Lock()
	offset := time.Duration(w.rnd.Int64N(int64(w.o.JobInterval) + 1))
	w.mu.Unlock()
	select {
	case <-ctx.Done():
		return
	case <-time.After(offset):
	}
	t := time.NewTicker(w.o.JobInterval)
	defer t.Stop()
	for {
		jobs, err := w.kube.BatchV1().Jobs(ns).List(ctx, metav1.ListOptions{LabelSelector: "hcsi-lab-job=backup"})
		if err == nil {
			active := false
			var done []batchv1.Job
			for _, j := range jobs.Items {
				if finished(&j) {
					done = append(done, j)
				} else {
					active = true
				}
			}
			sort.Slice(done, func(i, j int) bool { return done[i].CreationTimestamp.Before(&done[j].CreationTimestamp) })
			for i := 0; i < len(done)-2; i++ {
				_ = w.kube.BatchV1().Jobs(ns).Delete(ctx, done[i].Name, metav1.DeleteOptions{PropagationPolicy: ptr.To(metav1.DeletePropagationBackground)})
			}
			if !active {
				n++
				job := &batchv1.Job{
					ObjectMeta: metav1.ObjectMeta{GenerateName: "backup-", Labels: map[string]string{"hcsi-lab-job": "backup"}},
					Spec:       batchv1.JobSpec{BackoffLimit: ptr.To[int32](2), Template: w.backupPod()},
				}
				if _, err := w.kube.BatchV1().Jobs(ns).Create(ctx, job, metav1.CreateOptions{}); err != nil {
					logger.V(2).Info("creating a backup Job failed", "err", err)
				} else {
					w.mu.Lock()
					w.jobs++
					w.mu.Unlock()
				}
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func finished(j *batchv1.Job) bool {
	for _, c := range j.Status.Conditions {
		if (c.Type == batchv1.JobComplete || c.Type == batchv1.JobFailed) && c.Status == corev1.ConditionTrue {
			return true
		}
	}
	return false
}

// moveLoop moves one running database to another node every MoveInterval:
// it pins the StatefulSet's pod template to the other node, and the
// StatefulSet controller replaces the pod (delete, wait, create) so the
// volume detaches from one node and attaches to the other.
func (w *Workload) moveLoop(ctx context.Context) {
	w.everyRunningDB(ctx, w.o.MoveInterval, func(ns string, pod *corev1.Pod) bool {
		if err := w.move(ctx, ns, pod); err != nil {
			klog.FromContext(ctx).V(2).Info("moving a database failed", "namespace", ns, "err", err)
		}
		return true
	})
}

// everyRunningDB calls fn every interval with a running database of a random
// namespace (a tick that finds none is skipped), until ctx ends or fn
// returns false; one call ends before the next begins.
func (w *Workload) everyRunningDB(ctx context.Context, interval time.Duration, fn func(ns string, pod *corev1.Pod) bool) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		ns := w.randomNamespace()
		if pod, ok := w.runningDB(ctx, ns); ok && !fn(ns, pod) {
			return
		}
	}
}

func (w *Workload) randomNamespace() string {
	nss := w.Namespaces()
	w.mu.Lock()
	defer w.mu.Unlock()
	return nss[w.rnd.IntN(len(nss))]
}

// runningDB is ns's database pod if it runs.
func (w *Workload) runningDB(ctx context.Context, ns string) (*corev1.Pod, bool) {
	pod, err := w.kube.CoreV1().Pods(ns).Get(ctx, "db-0", metav1.GetOptions{})
	if err != nil || pod.Status.Phase != corev1.PodRunning || pod.DeletionTimestamp != nil {
		return nil, false
	}
	return pod, true
}

// move pins ns's database to a node other than pod's.
func (w *Workload) move(ctx context.Context, ns string, pod *corev1.Pod) error {
	var others []string
	for _, n := range w.o.Nodes {
		if n != pod.Spec.NodeName {
			others = append(others, n)
		}
	}
	if len(others) == 0 {
		return nil
	}
	w.mu.Lock()
	to := others[w.rnd.IntN(len(others))]
	w.mu.Unlock()
	patch, _ := json.Marshal(map[string]any{"spec": map[string]any{"template": map[string]any{"spec": map[string]any{
		"nodeSelector": map[string]string{"kubernetes.io/hostname": to}}}}})
	if _, err := w.kube.AppsV1().StatefulSets(ns).Patch(ctx, "db", types.StrategicMergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return err
	}
	w.mu.Lock()
	w.moves++
	w.mu.Unlock()
	klog.FromContext(ctx).V(2).Info("moving database", "namespace", ns, "from", pod.Spec.NodeName, "to", to)
	return nil
}

// expandLoop expands one running database's claim every ExpandInterval,
// one at a time: it grows the claim's request by ExpandStep, waits until
// the claim reports the new size with no resize pending (the resizer's
// ControllerExpandVolume, then the kubelet's NodeExpandVolume on the
// mounted volume), then moves the database, whose next start verifies every
// record it acknowledged before: the data must survive the expansion.
func (w *Workload) expandLoop(ctx, lifetime context.Context) {
	w.everyRunningDB(ctx, w.o.ExpandInterval, func(ns string, pod *corev1.Pod) bool {
		e, ok := w.expand(lifetime, ns, pod)
		if !ok {
			return true
		}
		if e.Err == nil && ctx.Err() == nil {
			if pod, ok := w.runningDB(ctx, ns); ok {
				_ = w.move(ctx, ns, pod)
			}
		}
		if e.Err != nil && lifetime.Err() != nil {
			return false // the lab stopped first: not the expansion's fault
		}
		if w.o.OnExpansion != nil {
			w.o.OnExpansion(e)
		}
		return true
	})
}

const dbClaim = "data-db-0"

var errClaimGone = errors.New("claim deleted")

func (w *Workload) expand(ctx context.Context, ns string, pod *corev1.Pod) (Expansion, bool) {
	logger := klog.FromContext(ctx).WithValues("namespace", ns, "claim", dbClaim)
	pvcs := w.kube.CoreV1().PersistentVolumeClaims(ns)
	pvc, err := pvcs.Get(ctx, dbClaim, metav1.GetOptions{})
	if err != nil || pvc.Status.Phase != corev1.ClaimBound {
		return Expansion{}, false
	}
	from := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
	if have := pvc.Status.Capacity[corev1.ResourceStorage]; have.Cmp(from) < 0 {
		return Expansion{}, false // an earlier expansion is still going on
	}
	to := from.DeepCopy()
	to.Add(w.o.ExpandStep)
	e := Expansion{Namespace: ns, Claim: dbClaim, Node: pod.Spec.NodeName, From: from, To: to, Requested: time.Now()}
	patch, _ := json.Marshal(map[string]any{"spec": map[string]any{"resources": map[string]any{"requests": map[string]string{"storage": to.String()}}}})
	if _, err := pvcs.Patch(ctx, dbClaim, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		logger.V(2).Info("expanding a claim failed", "err", err)
		return Expansion{}, false
	}
	logger.V(2).Info("expanding claim", "from", from.String(), "to", to.String(), "node", pod.Spec.NodeName)
	var last string
	err = wait.PollUntilContextTimeout(ctx, time.Second, w.o.ExpandTimeout, true, func(ctx context.Context) (bool, error) {
		pvc, err := pvcs.Get(ctx, dbClaim, metav1.GetOptions{})
		if apierrors.IsNotFound(err) || (err == nil && pvc.DeletionTimestamp != nil) {
			return false, errClaimGone
		}
		if err != nil {
			if ctx.Err() == nil { // not the wait's own deadline: keep the claim's last state
				last = err.Error()
			}
			return false, nil
		}
		have := pvc.Status.Capacity[corev1.ResourceStorage]
		last = fmt.Sprintf("capacity %s, conditions %v, allocated resource statuses %v", have.String(), pvc.Status.Conditions, pvc.Status.AllocatedResourceStatuses)
		if have.Cmp(to) < 0 || pvc.Status.AllocatedResourceStatuses[corev1.ResourceStorage] != "" {
			return false, nil
		}
		for _, c := range pvc.Status.Conditions {
			if c.Type == corev1.PersistentVolumeClaimFileSystemResizePending || c.Type == corev1.PersistentVolumeClaimResizing {
				return false, nil
			}
		}
		return true, nil
	})
	switch {
	case errors.Is(err, errClaimGone):
		// The workload is being deleted (the lab quiesces): nothing to judge.
		logger.V(2).Info("claim deleted while expanding", "to", to.String())
		return Expansion{}, false
	case err != nil:
		e.Err = fmt.Errorf("not done after %s (%s)", time.Since(e.Requested).Round(time.Second), last)
	default:
		e.Done = time.Now()
	}
	logger.V(2).Info("claim expansion ended", "to", to.String(), "err", e.Err)
	return e, true
}

// Moves counts database moves started.
func (w *Workload) Moves() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.moves
}

// Suspend stops new backup runs: CronJobs suspended (LabJobs stop with
// Run's context).
func (w *Workload) Suspend(ctx context.Context) error {
	if w.o.LabJobs {
		return nil
	}
	patch := []byte(`{"spec":{"suspend":true}}`)
	for _, ns := range w.Namespaces() {
		if _, err := w.kube.BatchV1().CronJobs(ns).Patch(ctx, "backup", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
	}
	return nil
}

// WaitJobsDone waits until no backup Job is running.
func (w *Workload) WaitJobsDone(ctx context.Context) error {
	return wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
		for _, ns := range w.Namespaces() {
			jobs, err := w.kube.BatchV1().Jobs(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, nil
			}
			for _, j := range jobs.Items {
				if !finished(&j) {
					return false, nil
				}
			}
		}
		return true, nil
	})
}

// Delete deletes the workload's namespaces (and so their StatefulSets, Jobs,
// pods and claims) and waits until the namespaces are gone.
func (w *Workload) Delete(ctx context.Context) error {
	for _, ns := range w.Namespaces() {
		if err := w.kube.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
	}
	return wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
		for _, ns := range w.Namespaces() {
			if _, err := w.kube.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				return false, nil
			}
		}
		return true, nil
	})
}
