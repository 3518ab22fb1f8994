package simharvester

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	admregv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listerscorev1 "k8s.io/client-go/listers/core/v1"
	listersstoragev1 "k8s.io/client-go/listers/storage/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
)

const (
	validationPath = "/v1/webhook/validation"
	mutationPath   = "/v1/webhook/mutation"
)

// Options configure the webhooks.
type Options struct {
	// Release picks the rules and messages (required).
	Release Release
	// TerminationGracePeriod is what the mutator writes into a template
	// without one (default DefaultTerminationGracePeriod).
	TerminationGracePeriod int64
	// CacheLag holds every VM event this long before the validator's cache
	// shows it, as a busy webhook pod's informer lags: right after a volume
	// left one VM, the validator still sees it there. 0: as the informer
	// delivers.
	CacheLag time.Duration
}

// Server serves Harvester's webhooks and keeps them registered.
type Server struct {
	o      Options
	kube   kubernetes.Interface
	vmInf  cache.SharedIndexInformer
	cache  *vmCache
	pvcs   listerscorev1.PersistentVolumeClaimLister
	scs    listersstoragev1.StorageClassLister
	caPEM  []byte
	cert   tls.Certificate
	addr   string // 127.0.0.1:port, kept across an outage
	runCtx context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu  sync.Mutex
	srv *http.Server // nil while down
}

// Start reads VMs, PVCs and classes through informers as Harvester's caches
// do, serves the webhooks on 127.0.0.1 and registers them; it returns once
// the API server calls them. They run until Stop.
func Start(ctx context.Context, cfg *rest.Config, o Options) (*Server, error) {
	if !o.Release.valid() {
		return nil, fmt.Errorf("simharvester: release %q: want %s, %s or %s", o.Release, V1_6, V1_7, V1_8)
	}
	if o.TerminationGracePeriod == 0 {
		o.TerminationGracePeriod = DefaultTerminationGracePeriod
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	kv, err := kubevirt.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	s := &Server{o: o, kube: kube}
	runCtx, cancel := context.WithCancel(klog.NewContext(context.WithoutCancel(ctx), klog.FromContext(ctx).WithName("simharvester")))
	s.runCtx, s.cancel = runCtx, cancel
	if err := s.start(ctx, runCtx, kv); err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

func (s *Server) start(ctx, runCtx context.Context, kv kubevirt.Interface) error {
	s.vmInf = cache.NewSharedIndexInformer(
		cache.NewListWatchFromClient(kv.KubevirtV1().RESTClient(), "virtualmachines", metav1.NamespaceAll, fields.Everything()),
		&kubevirtv1.VirtualMachine{}, 0, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	s.cache = newVMCache(s.o.CacheLag)
	if _, err := s.vmInf.AddEventHandler(s.cache.handler()); err != nil {
		return err
	}
	s.wg.Go(func() { s.cache.run(runCtx) })
	f := informers.NewSharedInformerFactory(s.kube, 0)
	s.pvcs = f.Core().V1().PersistentVolumeClaims().Lister()
	s.scs = f.Storage().V1().StorageClasses().Lister()
	f.Start(runCtx.Done())
	s.wg.Go(func() { s.vmInf.RunWithContext(runCtx) })
	s.wg.Go(func() {
		<-runCtx.Done()
		f.Shutdown()
	})
	if !cache.WaitForCacheSync(ctx.Done(), s.vmInf.HasSynced) {
		return errors.New("simharvester: VM cache did not sync")
	}
	for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("simharvester: %v cache did not sync", typ)
		}
	}
	var err error
	if s.caPEM, s.cert, err = testenv.LoopbackServing("harvester-webhook"); err != nil {
		return err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	s.addr = ln.Addr().String()
	s.serve(runCtx, ln)
	return s.register(ctx)
}

// serve answers on ln until Outage or Stop.
func (s *Server) serve(ctx context.Context, ln net.Listener) {
	mux := http.NewServeMux()
	mux.HandleFunc(validationPath, s.review(ctx, s.validate))
	mux.HandleFunc(mutationPath, s.review(ctx, s.mutate))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second,
		TLSConfig: &tls.Config{Certificates: []tls.Certificate{s.cert}, MinVersion: tls.VersionTLS12}}
	s.mu.Lock()
	s.srv = srv
	s.mu.Unlock()
	s.wg.Go(func() {
		if err := srv.ServeTLS(ln, "", ""); err != nil && !errors.Is(err, http.ErrServerClosed) {
			klog.FromContext(ctx).Error(err, "Harvester webhook server stopped")
		}
	})
}

// register writes the two configurations as harvester v1.8.2
// pkg/webhook/server/server.go:159-202 does (one webhook each, no timeout
// set so the API server's 10 s applies, validator failurePolicy Fail,
// mutator Ignore), with the rules of the modelled resources only and a URL
// in place of the harvester-webhook Service, which a bare API server cannot
// route to. Then it waits until the validator is called.
func (s *Server) register(ctx context.Context) error {
	url := "https://" + s.addr
	rule := func(group, resource string, ops ...admregv1.OperationType) admregv1.RuleWithOperations {
		names := []string{resource}
		if resource == "virtualmachines" {
			names = append(names, "virtualmachines/status")
		}
		return admregv1.RuleWithOperations{Operations: ops, Rule: admregv1.Rule{
			APIGroups: []string{group}, APIVersions: []string{"v1"}, Resources: names, Scope: ptr.To(admregv1.NamespacedScope)}}
	}
	vcfg := &admregv1.ValidatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: ValidatingConfigName},
		Webhooks: []admregv1.ValidatingWebhook{{
			Name:         ValidatorName,
			ClientConfig: admregv1.WebhookClientConfig{URL: ptr.To(url + validationPath), CABundle: s.caPEM},
			Rules: []admregv1.RuleWithOperations{
				rule(kubevirtv1.GroupVersion.Group, "virtualmachines", admregv1.Create, admregv1.Update),
				// Harvester's PVC validator takes CREATE (1.7 on), UPDATE
				// and DELETE; of its rules only the one on DELETE is
				// modelled, CREATE is here for the start-up probe.
				rule("", "persistentvolumeclaims", admregv1.Create, admregv1.Delete),
			},
			FailurePolicy:           ptr.To(admregv1.Fail),
			SideEffects:             ptr.To(admregv1.SideEffectClassNone),
			AdmissionReviewVersions: []string{"v1", "v1beta1"},
		}},
	}
	mutating := rule(kubevirtv1.GroupVersion.Group, "virtualmachines", admregv1.Create, admregv1.Update)
	mutating.Resources = []string{"virtualmachines"} // the mutator takes no status writes
	mcfg := &admregv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: MutatingConfigName},
		Webhooks: []admregv1.MutatingWebhook{{
			Name:                    MutatorName,
			ClientConfig:            admregv1.WebhookClientConfig{URL: ptr.To(url + mutationPath), CABundle: s.caPEM},
			Rules:                   []admregv1.RuleWithOperations{mutating},
			FailurePolicy:           ptr.To(admregv1.Ignore),
			SideEffects:             ptr.To(admregv1.SideEffectClassNone),
			AdmissionReviewVersions: []string{"v1", "v1beta1"},
		}},
	}
	if _, err := s.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations().Create(ctx, vcfg, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("simharvester: register %s: %w", vcfg.Name, err)
	}
	if _, err := s.kube.AdmissionregistrationV1().MutatingWebhookConfigurations().Create(ctx, mcfg, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("simharvester: register %s: %w", mcfg.Name, err)
	}
	return s.waitCalled(ctx)
}

// probeName is a claim name no test uses: the validator refuses creating
// it with probeMessage, which tells that the API server calls this server.
const (
	probeName    = "simharvester-probe"
	probeMessage = "simharvester webhook probe"
)

// waitCalled polls with dry-run creates of the probe claim until the API
// server's webhook source has picked the configuration up.
func (s *Server) waitCalled(ctx context.Context) error {
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: probeName, Namespace: metav1.NamespaceDefault},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Mi")}},
		},
	}
	return wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := s.kube.CoreV1().PersistentVolumeClaims(pvc.Namespace).Create(ctx, pvc, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err != nil && strings.Contains(err.Error(), probeMessage), nil
	})
}

// review serves f, with the server's context, as an admission webhook.
func (s *Server) review(ctx context.Context, f func(context.Context, *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse) http.HandlerFunc {
	return testenv.AdmissionHandler(func(req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse { return f(ctx, req) })
}

func (s *Server) validate(ctx context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	var d *denial
	switch req.Resource.Resource {
	case "virtualmachines":
		vm := &kubevirtv1.VirtualMachine{}
		if err := json.Unmarshal(req.Object.Raw, vm); err != nil {
			d = &denial{code: http.StatusInternalServerError, reason: metav1.StatusReasonInternalError, message: err.Error()}
			break
		}
		d = occupied(s.o.Release, s, vm)
		if d != nil {
			klog.FromContext(ctx).V(2).Info("Harvester validator denied a VM write", "vm", klog.KObj(vm), "subresource", req.SubResource, "user", req.UserInfo.Username, "reason", d.message)
		}
	case "persistentvolumeclaims":
		if req.Operation == admissionv1.Create {
			if req.Name == probeName {
				d = invalid("", "%s", probeMessage)
			}
			break
		}
		pvc := &corev1.PersistentVolumeClaim{}
		if err := json.Unmarshal(req.OldObject.Raw, pvc); err != nil {
			d = &denial{code: http.StatusInternalServerError, reason: metav1.StatusReasonInternalError, message: err.Error()}
			break
		}
		d = pvcDelete(s.o.Release, s, req.UserInfo.Username, pvc)
	}
	if d == nil {
		return &admissionv1.AdmissionResponse{Allowed: true}
	}
	return &admissionv1.AdmissionResponse{Allowed: false, Result: d.status()}
}

func (s *Server) mutate(_ context.Context, req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
	vm := &kubevirtv1.VirtualMachine{}
	if err := json.Unmarshal(req.Object.Raw, vm); err != nil {
		return &admissionv1.AdmissionResponse{Allowed: true}
	}
	resp := &admissionv1.AdmissionResponse{Allowed: true}
	if p := gracePatch(vm, s.o.TerminationGracePeriod); p != nil {
		resp.Patch = p
		resp.PatchType = ptr.To(admissionv1.PatchTypeJSONPatch)
	}
	return resp
}

// The lookup Harvester's caches give the rules.

func (s *Server) vms(namespace string) []*kubevirtv1.VirtualMachine { return s.cache.list(namespace) }

func (s *Server) pvc(namespace, name string) *corev1.PersistentVolumeClaim {
	p, err := s.pvcs.PersistentVolumeClaims(namespace).Get(name)
	if err != nil {
		return nil
	}
	return p
}

func (s *Server) provisioner(pvc *corev1.PersistentVolumeClaim) string {
	for _, a := range []string{"volume.beta.kubernetes.io/storage-provisioner", "volume.kubernetes.io/storage-provisioner"} {
		if p := pvc.Annotations[a]; p != "" {
			return p
		}
	}
	if pvc.Spec.StorageClassName == nil {
		return ""
	}
	sc, err := s.scs.Get(*pvc.Spec.StorageClassName)
	if err != nil {
		return ""
	}
	return sc.Provisioner
}

// Stop unregisters the webhooks (so the API server does not call a dead
// one) and stops serving.
func (s *Server) Stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if s.caPEM != nil {
		if err := s.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations().Delete(ctx, ValidatingConfigName, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			klog.FromContext(ctx).V(1).Info("Could not remove the Harvester webhook configuration", "name", ValidatingConfigName, "err", err)
		}
		if err := s.kube.AdmissionregistrationV1().MutatingWebhookConfigurations().Delete(ctx, MutatingConfigName, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			klog.FromContext(ctx).V(1).Info("Could not remove the Harvester webhook configuration", "name", MutatingConfigName, "err", err)
		}
	}
	s.shutdown()
	s.cancel()
	s.wg.Wait()
}

func (s *Server) shutdown() {
	s.mu.Lock()
	srv := s.srv
	s.srv = nil
	s.mu.Unlock()
	if srv == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := srv.Shutdown(ctx); err != nil {
		_ = srv.Close()
	}
}

// Down takes the webhook service away, as a Harvester upgrade does while
// its webhook pod restarts: the configurations stay, so with failurePolicy
// Fail every VM write (and every claim deletion) fails with "failed calling
// webhook" until Up; the mutator's Ignore lets its writes through unmutated.
func (s *Server) Down() {
	s.shutdown()
	klog.FromContext(s.runCtx).Info("Harvester webhook service down", "addr", s.addr)
}

// Up serves the webhooks again on the same address.
func (s *Server) Up() error {
	s.mu.Lock()
	up := s.srv != nil
	s.mu.Unlock()
	if up {
		return nil
	}
	ln, err := net.Listen("tcp", s.addr)
	if err != nil {
		return fmt.Errorf("simharvester: serve again on %s: %w", s.addr, err)
	}
	s.serve(s.runCtx, ln)
	klog.FromContext(s.runCtx).Info("Harvester webhook service up", "addr", s.addr)
	return nil
}

// IsDown reports whether the service is away.
func (s *Server) IsDown() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.srv == nil
}

// Holders are the VMs whose template names claim as the validator's cache
// shows them now (with Options.CacheLag, behind the API server).
func (s *Server) Holders(namespace, claim string) []string {
	var out []string
	for _, vm := range s.cache.list(namespace) {
		if slices.Contains(templateClaims(vm, false), claim) {
			out = append(out, vm.Name)
		}
	}
	slices.Sort(out)
	return out
}
