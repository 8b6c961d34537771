#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e3+t.tv_nsec/1e6;}
int main(int argc,char**argv){
  long mb=atol(argv[1]);
  double *ms=malloc(sizeof(double)*mb);
  for(long i=0;i<mb;i++){
    char*p=mmap(0,1<<20,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
    double t=now(); memset(p,0xff,1<<20); ms[i]=now()-t;
  }
  for(long s=0;s<mb;s+=mb/8){double sum=0,mx=0;for(long i=s;i<s+mb/8&&i<mb;i++){sum+=ms[i];if(ms[i]>mx)mx=ms[i];}
    printf("MiB %5ld-%5ld: mean %.3f ms/MiB, max %.3f\n",s,s+mb/8,sum/(mb/8),mx);}
}
